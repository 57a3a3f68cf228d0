"""Gyms: the UserRL environments and tau-bench retail/airline behind one async protocol."""
