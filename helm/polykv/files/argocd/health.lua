-- Argo CD health of a PolyKV object (PolyKVEngine, PolyKVPool, AdmissionPolicy), from its
-- metadata and the kstatus conditions the operator writes (Ready, Reconciling, Stalled).
--   deleting                          Progressing (names the finalizers it waits on)
--   no status, or status for an older generation
--                                     Progressing (the operator has not looked yet)
--   Stalled=True                      Degraded   (the spec needs a fix: reason and message)
--   an engine scaled to zero          Suspended
--   Ready=True                        Healthy
--   Reconciling=True, Ready Unknown   Progressing
--   anything else                     Degraded
local hs = {status = "Progressing", message = "Waiting for the PolyKV operator"}

local function find(conditions, ctype)
  if conditions == nil then return nil end
  for _, c in ipairs(conditions) do
    if c.type == ctype then return c end
  end
  return nil
end

local function describe(c)
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then text = text .. ": " .. c.message end
  return text
end

-- The health `status` when condition `c` is present and True, with its reason and message.
local function when_true(c, status)
  if c == nil or c.status ~= "True" then return nil end
  return {status = status, message = describe(c)}
end

local meta = obj.metadata or {}
if meta.deletionTimestamp ~= nil then
  hs.message = "Being deleted"
  if meta.finalizers ~= nil and #meta.finalizers > 0 then
    hs.message = "Being deleted, blocked by finalizers: " .. table.concat(meta.finalizers, ", ")
  end
  return hs
end

local st = obj.status
if st == nil or st.observedGeneration == nil then
  return hs
end
if meta.generation ~= nil and st.observedGeneration < meta.generation then
  hs.message = "The operator has not observed generation " .. meta.generation ..
    " yet (status is for " .. st.observedGeneration .. ")"
  return hs
end

local stalled = when_true(find(st.conditions, "Stalled"), "Degraded")
if stalled ~= nil then return stalled end

if obj.kind == "PolyKVEngine" and obj.spec ~= nil and obj.spec.replicas == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to zero replicas"
  return hs
end

local ready = find(st.conditions, "Ready")
local healthy = when_true(ready, "Healthy")
if healthy ~= nil then return healthy end
local reconciling = when_true(find(st.conditions, "Reconciling"), "Progressing")
if reconciling ~= nil then return reconciling end
if ready == nil then
  hs.message = "No Ready condition yet"
  return hs
end
if ready.status == "Unknown" then
  hs.message = describe(ready)
  return hs
end

hs.status = "Degraded"
hs.message = describe(ready)
return hs
