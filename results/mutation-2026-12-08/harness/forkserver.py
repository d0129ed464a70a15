"""A fork server for mutmut 2.x's runner: imports TVM and the other third-party modules once
(5-6 s a start), then forks a child per request that imports souffle_tvm afresh from disk (the
mutant mutmut has just written) and runs pytest in-process. souffle_tvm itself is never imported
in the server. Usage: python forkserver.py SOCKET PREMODS.json REPO  (client: runner_client.py)."""
import importlib, json, os, select, signal, socket, sys

sock_path, premods, repo = sys.argv[1], sys.argv[2], sys.argv[3]
sys.dont_write_bytecode = True
for name in json.load(open(premods)):
    if name.startswith(("souffle_tvm", "__")) or name in sys.modules:
        continue
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert not any(m.startswith("souffle_tvm") for m in sys.modules), "souffle_tvm imported in the server"
import pytest  # noqa: E402

if os.path.exists(sock_path):
    os.unlink(sock_path)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sock_path)
srv.listen(4)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    req = json.loads(conn.makefile().readline())
    pid = os.fork()
    if pid == 0:
        srv.close()
        conn.close()
        os.setsid()
        os.chdir(repo)
        sys.path[:0] = [repo, os.path.join(repo, "tests")]
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            rc = pytest.main(req["args"])
        except BaseException:
            import traceback
            traceback.print_exc()
            rc = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(rc))
    rc = None
    while rc is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        r, _, _ = select.select([conn], [], [], 0.05)
        if r and not conn.recv(1, socket.MSG_PEEK):      # the client went away (mutmut's timeout)
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = -9
    try:
        conn.sendall(f"{rc}\n".encode())
    except OSError:
        pass
    conn.close()
