"""ddpdoctor's start-up bootstrap, found through PYTHONPATH in every process of a traced job.

It must be invisible: it runs the ``sitecustomize`` that would have run without it, imports
neither torch nor click, and only installs an import hook that patches torch.distributed once
the program itself imports torch.
"""


def _ddpdoctor_bootstrap() -> None:
    import importlib
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    # Take ourselves off sys.path, then run the next sitecustomize (the user's or the distro's).
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except Exception as exc:
        # What site.py does with a failing sitecustomize, and then carry on with ours.
        if not (isinstance(exc, ImportError) and exc.name == "sitecustomize"):
            if sys.flags.verbose:
                sys.excepthook(*sys.exc_info())
            else:
                sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                                 f"{type(exc).__name__}: {exc}\n")
    finally:
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours

    if not os.environ.get("DDPDOCTOR_OUT"):
        return
    home = os.environ.get("DDPDOCTOR_HOME")
    try:
        import ddpdoctor.rank.activate as activate
    except ImportError:
        if not home:
            return
        sys.path.append(home)
        try:
            import ddpdoctor.rank.activate as activate
        except ImportError:
            return
    activate.install_import_hook()


_ddpdoctor_bootstrap()
del _ddpdoctor_bootstrap
