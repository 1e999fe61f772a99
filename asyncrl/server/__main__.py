"""``python -m asyncrl.server``: the 0.1.0 spelling of ``python -m asyncrl.engine``."""

from asyncrl.engine.__main__ import main

if __name__ == "__main__":
    main()
