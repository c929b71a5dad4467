"""Building blocks of the SUT: router, MoE-FFD, MoMHA, relative positions, halting, block."""
