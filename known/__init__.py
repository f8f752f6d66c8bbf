"""zerostate.known: what zerostate knows about DeepSpeed's bugs and limitations -- the known-issue table,
and the step that labels a finding with the issue whose mechanism its own evidence shows."""
