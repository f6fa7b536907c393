// A NATS user outside the project: the official JavaScript client, configured only from the
// variables `asyncrl up` leaves in runs/<id>/nats.env (the ones the `nats` CLI reads). Prints one
// JSON line: what it could read, and how each write it tried was answered.
import { connect } from "@nats-io/transport-node";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";
import { Kvm } from "@nats-io/kv";

const [bucket, key, subject, stream, consumer] = process.argv.slice(2);
const out = { writes: {} };
const nc = await connect({
  servers: process.env.NATS_URL.split(","),
  user: process.env.NATS_USER,
  pass: process.env.NATS_PASSWORD,
  timeout: 5000,
});
const jsm = await jetstreamManager(nc);
out.streams = [];
for await (const si of jsm.streams.list()) out.streams.push(si.config.name);
out.account_streams = (await jsm.getAccountInfo()).streams;
const ci = await jsm.consumers.info(stream, consumer);
out.consumer = { pending: ci.num_pending, ack_pending: ci.num_ack_pending, delivered: ci.delivered.stream_seq };
const kv = await new Kvm(nc).open(bucket);
const entry = await kv.get(key);
out.kv = entry ? new TextDecoder().decode(entry.value) : null;

async function refused(name, fn) {
  try {
    await fn();
    out.writes[name] = "accepted";
  } catch (e) {
    out.writes[name] = `refused: ${e.message}`;
  }
}
const js = jetstream(nc, { timeout: 3000 });
await refused("publish", () => js.publish(subject, new TextEncoder().encode("forged")));
await refused("kv_put", () => kv.put(key, "999"));
await refused("stream_delete", () => jsm.streams.delete(out.streams[0]));
await nc.close();
console.log(JSON.stringify(out));
