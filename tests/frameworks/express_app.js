// Express (4 or 5) upstream for tests/route_agreement.rs, with method-override for the
// three override headers. Usage: node express_app.js EXPRESS_DIR PORT, where EXPRESS_DIR
// holds node_modules/express and node_modules/method-override.
// GET /__count?key=K answers "N handler ...".
"use strict";
const path = require("path");
const [dir, port] = process.argv.slice(2);
const express = require(path.join(dir, "node_modules", "express"));
const methodOverride = require(path.join(dir, "node_modules", "method-override"));

const runs = new Map();
const app = express();
for (const header of ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"]) {
  app.use(methodOverride(header));
}
function handler(name) {
  return (req, res) => {
    const key = req.get("Idempotency-Key") || "";
    if (!runs.has(key)) runs.set(key, []);
    runs.get(key).push(name);
    res.status(201).send(`ran ${name}\n`);
  };
}
app.post("/v1/payments", handler("payments"));
app.post("/v1/orders/:id/pay", handler("pay"));
app.patch("/v1/orders/:id", handler("order"));
app.get("/__count", (req, res) => {
  const got = runs.get(String(req.query.key || "")) || [];
  res.type("text/plain").send(`${got.length} ${got.join(" ")}`);
});
app.listen(Number(port), "127.0.0.1");
