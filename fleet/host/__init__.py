"""How a fleet process hosts the kernel; shared by the client and the workers.

* ``loop``: one asyncio event loop in one thread, driven from synchronous code
  (``EventLoopThread``), and the guard every sync twin calls (``refuse_inside_loop``).
* ``kernel``: the store and the ``Runtime`` of a fleet process, built from the
  settings one way for every role (the dispatcher, a worker, the services).
* ``celery_api``: Celery behind one typed seam, and a bare app on a broker.

Nothing here imports ``fleet.dispatcher``, ``fleet.workers`` or the services:
they all import this.
"""
