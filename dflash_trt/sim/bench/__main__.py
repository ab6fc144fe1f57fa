"""`python -m dflash_trt.sim.bench`: see cli.py."""

from .cli import main

main()
