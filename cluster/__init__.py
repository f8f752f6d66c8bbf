"""Exploring on a Ray cluster: each lane of an exploration in a worker process on some node.

``zerostate explore --cluster ADDRESS`` (and ``diff``, ``bisect``) runs the explorer exactly as it runs
locally with ``--jobs N``; only where its workers live changes.  Each worker is a `remote.RemoteTarget`:
a `Target` whose runs go to a Ray actor (`host.LaneHost`) holding a real DeepSpeed target, in a placement
group that reserves the CPUs (GPUs on a GPU node) of the largest rank gang its scenarios can ask for, on
one node.  The explorer's deterministic merge is untouched, so the findings, their numbers, shrinking and
confirmation are those of the local run.  A worker (or node) that dies mid-lane is replaced and the lane
run again from its start (`remote.Retry`), so every example still runs after the same examples.

Ray is an optional extra (``zerostate[cluster]``): nothing here imports it at module level, and
`ray_api.require_ray` turns its absence into one clear error.  `local.LocalCluster` starts nodes on this
machine (``--cluster auto``, the tests, the benchmark), every one on the loopback address.
"""
