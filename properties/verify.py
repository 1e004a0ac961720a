"""``splitgrad verify`` (placeholder until the harness lands): reference self-checks."""

from __future__ import annotations

import sys

import torch


def main(argv: list[str]) -> int:
    from splitgrad import reference as ref

    torch.manual_seed(0)
    failures = 0
    for name, build, call in [
        ("Linear", lambda: ref.Linear(6, 5, params_dtype=torch.float64), lambda m, x: m(x)),
        ("GroupedLinear", lambda: ref.GroupedLinear(2, 6, 5, params_dtype=torch.float64),
         lambda m, x: m(x, [1, 2])),
    ]:
        m = build()
        x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
        ok = torch.autograd.gradcheck(lambda x: call(m, x), (x,), raise_exception=False)
        failures += not ok
        print(f"{name:16s} gradcheck {'ok' if ok else 'FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
