"""tau-bench retail and airline, re-implemented: domains, tools, copy-on-write databases and the tau gyms."""
