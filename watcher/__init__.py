"""zerostate.watcher: ``zerostate watch`` and ``zerostate.watch(engine)`` -- a user's own job traced and
checked online, its tracer, online checker, report and command together."""
