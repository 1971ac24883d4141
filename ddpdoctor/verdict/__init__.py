"""Verdicts shared by the live watchdog (``rank``) and the offline analysis: the hang diagnosis and
which rank to blame. Imports only ``ddpdoctor.trace``."""
