"""A room's rules, with no I/O.

Reading path: ``states`` (the states, the legal transitions, the failure reasons),
``record`` (one room on one node: the only place its state changes), ``gate`` (the pure
decision that lets a decode room reach SUCCESS only once its aux record landed and checked).
"""
