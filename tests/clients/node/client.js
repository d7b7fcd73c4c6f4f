// A specdec client that knows only proto/specdec/v1/generation.proto (no generated code from this project).
// Usage: node client.js ADDRESS METHOD REQUEST_JSON   (METHOD: Generate | GenerateStream | GetModelInfo)
// Prints one JSON line: the response (Generate, GetModelInfo), the list of chunks (GenerateStream), or
// {"error": {"code": ..., "details": ...}}.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, method, requestJson] = process.argv.slice(2);
const protoRoot = path.resolve(__dirname, "../../../proto");
const definition = protoLoader.loadSync("specdec/v1/generation.proto", {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const specdec = grpc.loadPackageDefinition(definition).specdec.v1;
const client = new specdec.GenerationService(address, grpc.credentials.createInsecure());
const request = JSON.parse(requestJson || "{}");
const deadline = new Date(Date.now() + 120000);

function fail(err) {
  console.log(JSON.stringify({ error: { code: grpc.status[err.code], details: err.details } }));
  process.exit(0);
}

if (method === "GenerateStream") {
  const chunks = [];
  const call = client.GenerateStream(request, { deadline });
  call.on("data", (chunk) => chunks.push(chunk));
  call.on("error", fail);
  call.on("end", () => console.log(JSON.stringify(chunks)));
} else {
  client[method](request, { deadline }, (err, response) => {
    if (err) fail(err);
    console.log(JSON.stringify(response));
  });
}
