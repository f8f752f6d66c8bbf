"""zerostate.reports: the reports the commands write, and nothing else -- their typed models, what fills them
beyond the run itself, and their rendering: report.json / report.md of a run (`report_folder`,
`report_markdown`), the diff report (`diff_report`, with the diff's classification by replay in
`diff_classify` and its memory comparison in `diff_memory`), the release matrix's report (`matrix_report`,
its cells by replay in `matrix_cells`), the pictures (`trace_picture`, `graph_picture`, drawn on `canvas`),
and the files written beside a finding (`repro_file`; a model counterexample's in `model_counterexample`)."""
