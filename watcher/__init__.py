"""zerostate.watcher: ``zerostate watch`` and ``zerostate.watch(engine)`` -- a user's own job traced and
checked online: its tracer, online checker, the job's launch (`job_launch`) and its merged report
(`job_report`).  The command itself is `zerostate.cli.cmd_watch`; the trace pictures are `zerostate.reports`'."""
