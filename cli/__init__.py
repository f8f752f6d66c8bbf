"""zerostate.cli: the ``zerostate`` command (`main`), one module per subcommand (``cmd_*``), the report
folder (`report`, `report_md`, pictures in `pictures` / `graph_picture` drawn on `canvas`), and the
terminal-only progress line (`progress`).  `targets_api` is the one place the CLI meets the targets."""
