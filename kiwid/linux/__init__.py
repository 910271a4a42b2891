"""Linux facts that several parts of kiwid read: one parser for each (stdlib only).

``/proc/PID/cgroup``, ``/proc/PID/stat``, ``/proc/self/mountinfo`` and the safe
reading of files an operator or another process may have put anywhere. The
adapters, the config loader, the hook and the daemon all read these through this
package, so that each format is parsed in exactly one place. It imports nothing
of kiwid and no foreign library.
"""
