"""The wrappers installed into torch in a traced process: collectives and p2p (``dist``), process
groups and rank start-up (``groups``), DDP (``ddp``), data/seeds/optimizers (``data``), file
operations (``files``) and how a rank ended (``exit``)."""

#: Set on every function ddpdoctor wrapped, so that a second installation never wraps a wrapper.
WRAPPED = "__ddpdoctor_wrapped__"
