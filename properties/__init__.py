"""splitgrad.properties — the conformance harness as a library."""
