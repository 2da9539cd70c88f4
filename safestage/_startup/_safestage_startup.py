"""safestage's interpreter start-up hook, installed as a top-level module beside
safestage.pth (Python <= 3.14) and safestage.start (PEP 829, Python >= 3.15).

It stays tiny and standard-library-only: on Python 3.15 the .start entry point imports it
on every start, so it decides from the environment alone, before anything of safestage is
imported. It never raises: a start-up hook that raises breaks every Python program.
"""

import os
import sys


def enabled(environ=os.environ):  # type: ignore[no-untyped-def]
    """SAFESTAGE_DIR non-blank, or SAFESTAGE set; SAFESTAGE=0 is checked by safestage."""
    return bool(environ.get("SAFESTAGE_DIR", "").strip() or environ.get("SAFESTAGE", "").strip())


def start():  # type: ignore[no-untyped-def]
    try:
        if enabled():
            from safestage._autoload import start_from_environment

            start_from_environment()
    except Exception as exc:  # a broken install must not break the interpreter
        sys.stderr.write(
            "safestage: start-up hook failed (%r); safetensors saves in this process are not staged\n"
            % (exc,)
        )
    finally:
        # Leave no trace in sys.modules: pytest would warn that it cannot assertion-rewrite a
        # module of a plugin's distribution that was imported before it started.
        sys.modules.pop(__name__, None)
