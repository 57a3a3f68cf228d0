"""Trainer -> engine weight sync: the process group both sides join, and the flat bucket layout they share."""
