#!/bin/sh
# Runs one rank's command and records its exit status in $FAILURE_PID_DIR/status<rank> (the
# file's time is when the rank ended).  With UNNOTICED_HIDE=1 it also keeps the launcher from
# noticing rank 1's death: once rank 1's process died (tests/jobs/failure/peer_lost.py wrote
# failed_at) this shell stays, as a node agent or a scheduler that reaps only its own process
# would; horovodrun --gloo has no setting for that.  The launcher ends the shell with the job;
# its pid is recorded so the test checks that it is gone too.
"$@"
status=$?
rank="${HOROVOD_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"
echo "$status" > "$FAILURE_PID_DIR/status$rank"
if [ "${UNNOTICED_HIDE:-0}" = 1 ] && [ "$rank" = 1 ] && [ -e "$FAILURE_PID_DIR/failed_at" ]; then
    echo $$ > "$FAILURE_PID_DIR/wrapper1.pid"
    exec sleep 200
fi
exit $status
