"""Offline analysis of a trace folder: load, run selection, alignment, the checks, findings and
the engine (load -> analyze -> exit code). Never imports ``ddpdoctor.rank``."""
