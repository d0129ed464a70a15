"""mutmut's runner: asks the fork server on SOCKET to run pytest with ARGS; exits 0 if the tests
pass, 1 otherwise (mutmut 2.x counts only exit code 1 as a kill)."""
import json, socket, sys
sock_path, log, args = sys.argv[1], sys.argv[2], sys.argv[3:]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock_path)
s.sendall((json.dumps({"args": args, "log": log}) + "\n").encode())
rc = int(s.makefile().readline().strip() or 1)
sys.exit(0 if rc == 0 else 1)
