"""What runs inside every traced process: bootstrap, activation, settings, the recorder, call
sites, the hang watchdog and the patches of torch (``rank.patches``).

Never imports ``ddpdoctor.analysis`` or ``ddpdoctor.render``: a rank stays cheap.
"""
