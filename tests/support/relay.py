"""A network's forwarding, in a test: what arrives on the port a roster names goes on to the port a party listens
on, as behind a NAT, in a container or behind a load balancer."""

import socket
import threading


class Relay:
    """Forwards every TCP connection to ``127.0.0.1:listen_port`` to ``127.0.0.1:to_port``, byte for byte."""

    def __init__(self, listen_port: int, to_port: int) -> None:
        self._to = ("127.0.0.1", to_port)
        self._server = socket.create_server(("127.0.0.1", listen_port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # the relay was closed
            try:
                upstream = socket.create_connection(self._to)
            except OSError:  # the server is not listening yet: the client connects again, as it would through a NAT
                client.close()
                continue
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def close(self) -> None:
        self._server.close()
