"""scorer: verified rewards with a cost penalty (`python -m scorer`), and λ calibration."""
