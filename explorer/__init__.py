"""zerostate.explorer: exploring a target with Hypothesis as a stream of typed events (`exploration_events`):
the scenario strategies (shared with the tests), then the phases generate (`generate`, `workers`), shrink
(`search`, the polish `simplify`) and confirm (`confirm`), driven by `exploration.Exploration`."""
