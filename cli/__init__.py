"""zerostate.cli: the ``zerostate`` command (`main`), one module per subcommand (``cmd_*``; the release
matrix that ``explore`` runs for a list of releases in `matrix`), what they share (`common`), and the
terminal-only progress line (`progress`).  `targets_api` is the one place the CLI meets the targets.  The
reports the commands write are `zerostate.reports`'."""
