"""Imports every built-in gym so that its @register_gym runs. Add new gyms here."""
