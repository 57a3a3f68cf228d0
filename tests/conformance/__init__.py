"""The engine conformance suite: every test runs against the embedded server and real SGLang."""
