/**
 * A fresh id for an attach the page starts (`lab-` and 128 random bits in
 * hex), which the page follows on the stream and may retry safely.
 *
 * Why not `crypto.randomUUID()`: browsers define it in secure contexts only
 * (https, or http on localhost). A hub served over plain http at another
 * address — common inside a cluster, and how the real node's hub tier serves
 * it — has no `randomUUID`, and every attach from the toolbar failed with
 * "crypto.randomUUID is not a function". `crypto.getRandomValues` exists in
 * every context.
 */
export function newRequestId(): string {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  const hex = Array.from(bytes, byte => byte.toString(16).padStart(2, '0'));
  return `lab-${hex.join('')}`;
}
