"""The Python upstreams of tests/route_agreement.rs, each as its users deploy it.

Usage: python_apps.py flask|fastapi|aiohttp|django PORT

Each has handlers for the protected routes (POST /v1/payments, POST
/v1/orders/{id}/pay, PATCH /v1/orders/{id}) that count their runs per
Idempotency-Key, and GET /__count?key=K, which answers "N handler ...".
"""

import sys
import threading

RUNS = {}
LOCK = threading.Lock()


def ran(key, handler):
    with LOCK:
        RUNS.setdefault(key or "", []).append(handler)


def count(key):
    with LOCK:
        got = list(RUNS.get(key or "", []))
    return "%d %s" % (len(got), " ".join(got))


def flask_app(port):
    from flask import Flask, request
    from werkzeug.serving import run_simple

    app = Flask("agreement")

    @app.post("/v1/payments")
    def payments():
        ran(request.headers.get("Idempotency-Key"), "payments")
        return "ran payments\n", 201

    @app.post("/v1/orders/<id>/pay")
    def pay(id):
        ran(request.headers.get("Idempotency-Key"), "pay")
        return "ran pay\n", 201

    @app.patch("/v1/orders/<id>")
    def order(id):
        ran(request.headers.get("Idempotency-Key"), "order")
        return "ran order\n", 201

    @app.get("/__count")
    def counts():
        return count(request.args.get("key"))

    run_simple("127.0.0.1", port, app, threaded=True)


def fastapi_app(port):
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    app = FastAPI()

    @app.post("/v1/payments")
    async def payments(request: Request):
        ran(request.headers.get("idempotency-key"), "payments")
        return PlainTextResponse("ran payments\n", status_code=201)

    @app.post("/v1/orders/{id}/pay")
    async def pay(id: str, request: Request):
        ran(request.headers.get("idempotency-key"), "pay")
        return PlainTextResponse("ran pay\n", status_code=201)

    @app.patch("/v1/orders/{id}")
    async def order(id: str, request: Request):
        ran(request.headers.get("idempotency-key"), "order")
        return PlainTextResponse("ran order\n", status_code=201)

    @app.get("/__count")
    async def counts(key: str = ""):
        return PlainTextResponse(count(key))

    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", log_level="warning")


def aiohttp_app(port):
    from aiohttp import web

    def handler(name):
        async def run(request):
            ran(request.headers.get("Idempotency-Key"), name)
            return web.Response(text="ran %s\n" % name, status=201)

        return run

    async def counts(request):
        return web.Response(text=count(request.query.get("key")))

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/payments", handler("payments")),
            web.post("/v1/orders/{id}/pay", handler("pay")),
            web.patch("/v1/orders/{id}", handler("order")),
            web.get("/__count", counts),
        ]
    )
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def django_app(port):
    # One-file Django: settings, a DefaultRouter with two ViewSets, served as ASGI by uvicorn.
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="agreement",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "rest_framework"],
        MIDDLEWARE=["django.middleware.common.CommonMiddleware"],
        DATABASES={},
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
            "UNAUTHENTICATED_USER": None,
        },
    )
    import django

    django.setup()
    from django.http import HttpResponse
    from django.urls import include, path
    from rest_framework import routers, viewsets
    from rest_framework.decorators import action
    from rest_framework.response import Response

    def key_of(request):
        return request.headers.get("Idempotency-Key")

    class PaymentViewSet(viewsets.ViewSet):
        def create(self, request, *args, **kwargs):
            ran(key_of(request), "payments")
            return Response("ran payments", status=201)

    class OrderViewSet(viewsets.ViewSet):
        def partial_update(self, request, *args, **kwargs):
            ran(key_of(request), "order")
            return Response("ran order", status=201)

        @action(detail=True, methods=["post"])
        def pay(self, request, *args, **kwargs):
            ran(key_of(request), "pay")
            return Response("ran pay", status=201)

    router = routers.DefaultRouter(trailing_slash=False)
    router.register("payments", PaymentViewSet, basename="payment")
    router.register("orders", OrderViewSet, basename="order")

    def counts(request):
        return HttpResponse(count(request.GET.get("key")))

    global urlpatterns
    urlpatterns = [path("v1/", include(router.urls)), path("__count", counts)]

    import uvicorn
    from django.core.asgi import get_asgi_application

    uvicorn.run(get_asgi_application(), host="127.0.0.1", port=port, http="httptools", log_level="warning")


if __name__ == "__main__":
    apps = {"flask": flask_app, "fastapi": fastapi_app, "aiohttp": aiohttp_app, "django": django_app}
    apps[sys.argv[1]](int(sys.argv[2]))
