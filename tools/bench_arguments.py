"""The flags every benchmark of tools/bench.sh takes for one row (qtrain bench's names), shared by the
Python anchors (tools/bench_anchor.py, tools/bench_unsloth.py). Imports nothing heavy: Unsloth must be
imported before torch."""


def add_row_arguments(parser):
    parser.add_argument("--quant", default="qlora", choices=["qlora", "none"])
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0,
                        help="only the shape's first N decoder layers (0: all; the Unsloth anchor's mixtures: 12)")
    parser.add_argument("--json", action="store_true")
