"""The weight path on the bus: how policy versions travel from the trainer to the workers.

One file per concern (this package imports none of them, so `import bus` stays light):

    rules.py      what both sides agree on: subjects, codec, the signed fields, `Refused`, the version rules
    publisher.py  trainer side: `WeightPublisher` (fenced writes) and its one interface,
                  `publish(EncodedVersion)`; `GatheredVersion` (a delta, optionally a keyframe)
    manifest.py   versions published from shards: `ShardedVersion` (the parts + one signed manifest),
                  and the worker's checks of a manifest and its parts
    follower.py   worker side: `WeightFollower` walks WEIGHTS and hands verified updates to a target
    blobs.py      payloads over the message size, in the object store `rl-blobs`
    regions.py    where a worker reads weights: the hub, or its region's mirrors

Trainer side: a keyframe (full bf16 state) every K versions and, for every version in between, a
sparse lossless delta of the whole state (`GatheredVersion`) or one delta part per trainer rank
announced by one manifest (`ShardedVersion`); signed, inline when small and in the object store
otherwise; then the KV key `version` is bumped so workers can measure their lag. The epoch, trainer
id (and a keyframe's model config) also travel inside the payload's container header, which the
signature covers. Every write is conditional on the server (expected last sequence of WEIGHTS): a
deposed leader's write is refused (`WeightPublisher`).

Worker side, `WeightFollower`: each reader keeps its own cursor (a stream sequence) on `WEIGHTS` and
walks the stream in order with direct gets (`next_by_subj`), woken by a plain NATS subscription, so
there is no consumer state on the server to lose on reconnect. Every update is checked before it
touches the weights:

    keyframe   accepted iff newer epoch, or same epoch and newer version; digest + signature;
               fields == the payload's signed header; epoch issued by the KV leader lease
    delta      epoch <  mine                      -> refused (deposed leader), no resync
               to_version <= mine, same epoch     -> replay, skipped
               from_version != mine               -> gap: resync from the latest keyframe
               bad signature / payload / codec    -> refused: resync
               fields != the signed header        -> refused (a forgery: the real one is in the stream)
               newer epoch the lease never issued -> refused
               target refuses (base digest)       -> refused: resync
    manifest   a version published from shards: the delta rules, then every part checked and the
               version applied whole or not at all (manifest.py)

Signing is what stops forgery: without a public key the field check only catches accidental
mismatches (anyone able to publish on rl.weights.> can then build a consistent payload), and
the lease check only bounds the epoch to one the KV has issued.

Resync loads the latest keyframe if it moves us forward and continues from it; otherwise
the reader keeps walking until a newer keyframe shows up. The target (an engine) keeps
generating meanwhile: it only ever sees whole, verified updates.
"""
