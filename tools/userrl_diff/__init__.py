"""The parts of `tools/diff_userrl.py`, the differential run of this project's gyms against UserRL's own code."""
