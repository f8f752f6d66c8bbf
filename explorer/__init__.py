"""zerostate.explorer: exploring a target with Hypothesis as a stream of typed events (`events`): the scenario
strategies (shared with the tests), then the phases generate (`generate`, `workers`), shrink (`search`, the
polish `simplify`) and confirm (`confirm`), driven by `explore.Exploration`."""
