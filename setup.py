"""The optional C extensions (ddpdoctor/rank/_*.c, ddpdoctor/analysis/_*.c); everything else is in pyproject.toml.

``optional=True``: where one cannot be built (no compiler, no Python headers) the install goes
on without them and the Python paths are used, with the same results."""

from setuptools import Extension, setup

_SHARED = ["ddpdoctor/rank/_native.h"]  # what the rank side's extensions share

setup(ext_modules=[Extension("ddpdoctor.rank._fastcall", ["ddpdoctor/rank/_fastcall.c"], depends=_SHARED, optional=True),
                   # the C audit filter (rank/auditfilter.py): unwatched audit events stay in C
                   Extension("ddpdoctor.rank._auditfilter", ["ddpdoctor/rank/_auditfilter.c"], optional=True),
                   # the call-site lookup's pass over library frames (rank/callsite.py)
                   Extension("ddpdoctor.rank._sitewalk", ["ddpdoctor/rank/_sitewalk.c"], optional=True),
                   # warnings.warn counting stacklevel over ddpdoctor's frames (rank/warnsite.py)
                   Extension("ddpdoctor.rank._warnsite", ["ddpdoctor/rank/_warnsite.c"], depends=_SHARED, optional=True),
                   # the DDP backward event and DD015's test (rank/patches/ddp.py, grads.py)
                   Extension("ddpdoctor.rank._ddpstep", ["ddpdoctor/rank/_ddpstep.c"], depends=_SHARED, optional=True),
                   # the loader's bulk path (analysis/fastscan.py): reading rank files for the report
                   Extension("ddpdoctor.analysis._bulkscan", ["ddpdoctor/analysis/_bulkscan.c"], optional=True),
                   # the Flight Recorder pickle reader (analysis/frnative.py)
                   Extension("ddpdoctor.analysis._frpickle", ["ddpdoctor/analysis/_frpickle.c"], optional=True)])
