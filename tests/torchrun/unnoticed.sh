#!/bin/sh
# One torchrun worker: runs its command and records the exit status in
# $FAILURE_PID_DIR/status<RANK> (the file's time is when the rank ended).  With UNNOTICED_HIDE=1
# it keeps torchrun from noticing rank 1's death: once rank 1's process died (peer_death.py
# wrote failed_at) this shell stays, as a node agent that reaps only its own process would;
# torchrun would otherwise stop the survivor at once, before it could show what it does.
# torchrun ends the shell with the job; its pid is recorded so the test checks it is gone.
"$@"
status=$?
echo "$status" > "$FAILURE_PID_DIR/status$RANK"
if [ "${UNNOTICED_HIDE:-0}" = 1 ] && [ "$RANK" = 1 ] && [ -e "$FAILURE_PID_DIR/failed_at" ]; then
    echo $$ > "$FAILURE_PID_DIR/wrapper1.pid"
    exec sleep 200
fi
exit $status
