"""splitgrad.impl — the optimized split-backward implementation (same API as the reference)."""
