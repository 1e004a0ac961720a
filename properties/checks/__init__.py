"""The checks of SPEC §7, one file per property group (P1-P3 accuracy, P4-P8 split, P9-P10
misuse, P11 memory, P12 grouped, P13 FP8, P17 input-only, P18 fidelity and protocol), the
registry that names them and the live module they observe; ``distributed/`` holds P14-P16."""
