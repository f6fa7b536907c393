"""Task environments: prompt generators, verifiers, the code sandbox and the task feeder."""

from . import arith, python_funcs, python_tests, swe_env  # noqa: F401  (register the built-in environments)
from .base import ENVS, Env, SpecError, TaskSpec, Verdict, get_env, register, runs_code  # noqa: F401
