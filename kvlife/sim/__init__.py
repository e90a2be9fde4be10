"""The decode-runtime simulator behind ``kvlife simulate``."""

from kvlife.sim.runtime import SimConfig, SimManager, SimReport, run_simulation

__all__ = ["SimConfig", "SimManager", "SimReport", "run_simulation"]
