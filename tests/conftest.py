"""Suite-wide setup.

A test runner started as a background job of a non-interactive shell (`cmd &`, as CI
scripts often do) inherits SIGINT ignored, and an ignored signal stays ignored across
exec: every daemon and CLI the tests spawn would then ignore the Ctrl-C that tests send
them (`kvctl watch` never exited; the demo ran to its end and exited 0). Restoring
Python's handler here gives the children SIGINT's default again (a handler, unlike
"ignored", is reset to the default on exec).

Under BLOCKD_NATIVE=on the run imports blockd's compiled core (blockd.native) in place
of the pure modules, before any test imports them: the same tests then check the
compiled build (`make test-native`).
"""

from __future__ import annotations

import os
import signal

from blockd import native

if os.environ.get(native.ENV, "").lower() == "on":
    native.enable("on")

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
