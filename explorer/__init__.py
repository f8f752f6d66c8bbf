"""zerostate.explorer: exploring a target with Hypothesis -- the scenario strategies (shared with the
tests), generation, shrinking and confirmation of findings."""
