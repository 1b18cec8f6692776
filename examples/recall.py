"""The associative-recall benchmark (MQAR) from a script: the same as `mixc recall`.

    python examples/recall.py                                      # the default set, about 11 min on 2 cores
    python examples/recall.py --specs gla,mamba2,gla+attention --lengths 64 --widths 32,64
    python examples/recall.py --specs path/to/my.mix,attention -o bench/results/mine

Trains small 2-layer MixerLMs (mixc.nn) on synthetic multi-query associative recall for each
spec, sequence length and width, and prints accuracy next to state size. See docs/recall.md."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # run from a checkout without install
from mixc.recall import add_arguments, main  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
