"""The float64 truth of a case and the rounding-error analysis that turns it into per-element
bounds; the tolerances themselves are constants in ``properties/budgets.py``."""
