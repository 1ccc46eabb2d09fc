"""The liveness channel: is every peer process still there, apart from whether it progresses.

* ``heartbeat``: ``Liveness``, the per-rank TCP heartbeat mesh and its loss events
  (``PeerEvent``), which the scheduler turns into ``dcredit_hvd.errors.PeerLostError``;
* ``channels``: a channel's leases (it ends with its last optimizer) and the ranks' agreement,
  at each construction, to reuse the one they all hold or open a new one;
* ``mesh``: its connections (dialling, redials, the connections still proving themselves);
* ``handshake``: both sides of the authenticated handshake (a secret shared over the job's
  own collective library);
* ``interfaces``: which address to listen on and dial;
* ``settings``: ``Settings``, its ``DCREDIT_LIVENESS_*`` variables and their validation.

Needs neither torch nor a collective library; each transport starts the channel for its group.
"""
