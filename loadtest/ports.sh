# Port helpers for the bench scripts (sourced). Ports are free when asked; another process
# could take one before the bench binds it, which on a bench machine is rare enough.

# A free port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The first of N consecutive free ports (a simulated fleet takes consecutive ports).
free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
n = int(sys.argv[1])
for first in range(20000, 60000, n + 1):
    sockets = []
    try:
        for port in range(first, first + n):
            s = socket.socket(); s.bind(("127.0.0.1", port)); sockets.append(s)
        print(first); break
    except OSError:
        pass
    finally:
        for s in sockets: s.close()
PY
}
