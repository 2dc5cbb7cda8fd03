"""The ground floor: process services any layer may use.

Failures the user acts on (``errors``), the process group and its timeouts (``distributed``),
stop requests (``stop_requests``) and the dump folder's checks and lock (``dump_folder``). Every
other part of the trainer may import these, so they import nothing of ``trainer`` outside this
package (only ``parallelisms.torch_private``, below everything): an import upward from here would
tie the bottom of the house to a floor above it. ``tests/test_layout.py`` keeps that true.
"""
