/*
 * EmberAppMaster - the ApplicationMaster of ember.yarn.run_on_yarn.
 *
 *   java <--add-opens ...> -cp <conf>:<yarn.application.classpath>:ember-yarn-am.jar \
 *        org.ember.yarn.EmberAppMaster ember-plan.json
 *
 * The client (python/ember/yarn/_client.py) stages everything on HDFS and
 * writes the task plan, a JSON file localized into this container:
 *
 *   {"user": "...", "attempt": 1, "report": "hdfs://.../am-report.json",
 *    "command": "<python> -m ember.yarn.task", "log_tail_bytes": 4096,
 *    "env": {...}, "resources": [{"name", "uri", "size", "timestamp", "type"}],
 *    "tasks": [{"type", "instances", "memory_mb", "vcores", "node_label"}]}
 *
 * It asks the ResourceManager for `instances` containers of each task type
 * (one priority per type, so an allocated container says which type it is
 * for), starts the command in each with EMBER_YARN_TASK=<type>:<index> added
 * to the environment, and watches the exits:
 *   - every chief/worker/evaluator container exited 0: ps and tensorboard
 *     containers (which serve until told otherwise) are stopped and the
 *     application ends SUCCEEDED;
 *   - any container exits non-zero (or cannot start): the AM fetches the tail
 *     of its stderr/stdout from its NodeManager while the logs are still
 *     there, stops the others and ends FAILED, the diagnostics naming the
 *     task, its exit code and its container.
 * Either way it writes a report (every task's container, host, exit status,
 * times; the failing task's log tails) to the plan's "report" path on HDFS,
 * which the client reads after the application has finished.
 *
 * Rendezvous, roles and the cluster spec are not the AM's business: the
 * tasks register with the client's authenticated Ember reservation server.
 * One attempt only (the client retries whole applications: a fresh
 * rendezvous with a fresh secret each time).
 */
package org.ember.yarn;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.URLEncoder;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Deque;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.io.DataOutputBuffer;
import org.apache.hadoop.security.Credentials;
import org.apache.hadoop.security.UserGroupInformation;
import org.apache.hadoop.security.token.Token;
import org.apache.hadoop.security.token.TokenIdentifier;
import org.apache.hadoop.yarn.api.ApplicationConstants;
import org.apache.hadoop.yarn.api.records.Container;
import org.apache.hadoop.yarn.api.records.ContainerExitStatus;
import org.apache.hadoop.yarn.api.records.ContainerId;
import org.apache.hadoop.yarn.api.records.ContainerLaunchContext;
import org.apache.hadoop.yarn.api.records.ContainerStatus;
import org.apache.hadoop.yarn.api.records.FinalApplicationStatus;
import org.apache.hadoop.yarn.api.records.LocalResource;
import org.apache.hadoop.yarn.api.records.LocalResourceType;
import org.apache.hadoop.yarn.api.records.LocalResourceVisibility;
import org.apache.hadoop.yarn.api.records.NodeReport;
import org.apache.hadoop.yarn.api.records.Priority;
import org.apache.hadoop.yarn.api.records.Resource;
import org.apache.hadoop.yarn.api.records.UpdatedContainer;
import org.apache.hadoop.yarn.api.records.URL;
import org.apache.hadoop.yarn.client.api.AMRMClient.ContainerRequest;
import org.apache.hadoop.yarn.client.api.async.AMRMClientAsync;
import org.apache.hadoop.yarn.client.api.async.NMClientAsync;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.security.AMRMTokenIdentifier;

public final class EmberAppMaster {
  /* chief, workers and evaluator decide the outcome; ps and tensorboard serve them */
  private static final List<String> DECIDING = List.of("chief", "worker", "evaluator");
  /* request priorities: the allocated container's priority names its task type */
  private static final List<String> TYPES = List.of("ps", "chief", "worker", "evaluator",
      "tensorboard");

  /** One task: a YARN container running `type:index`. */
  private static final class Task {
    final String type;
    final int index;
    Container container;
    long startedMs;
    long finishedMs;
    Integer exitStatus;
    String diagnostics = "";
    boolean stoppedByAm;
    final Map<String, String> logTail = new LinkedHashMap<>();

    Task(String type, int index) {
      this.type = type;
      this.index = index;
    }

    String name() {
      return type + ":" + index;
    }
  }

  /*
   * How often this AM heartbeats to the ResourceManager: while a task still
   * waits for its container (what it asked for arrives on the heartbeat
   * after the RM assigns it, so every heartbeat saved there is a task started
   * sooner; Spark's AM polls at 200 ms then too), and once every task has
   * one (a container's exit is seen on the next heartbeat).
   */
  private static final int ALLOCATING_HEARTBEAT_MS = 200;
  private static final int HEARTBEAT_MS = 1000;

  private final JsonNode plan;
  private final Configuration conf = new YarnConfiguration();
  private final Map<String, Deque<Task>> unassigned = new HashMap<>();
  private final Map<String, List<ContainerRequest>> requests = new HashMap<>();
  private final Map<ContainerId, Task> byContainer = new HashMap<>();
  private final List<Task> tasks = new ArrayList<>();
  private final Map<String, LocalResource> resources = new HashMap<>();
  private final CountDownLatch finished = new CountDownLatch(1);
  private ByteBuffer taskTokens;
  private AMRMClientAsync<ContainerRequest> rm;
  private NMClientAsync nm;
  private int deciding; // chief/worker/evaluator tasks not yet exited 0
  private boolean finishing;
  private FinalApplicationStatus status = FinalApplicationStatus.UNDEFINED;
  private String diagnostics = "";
  private Task failed;

  private EmberAppMaster(JsonNode plan) {
    this.plan = plan;
  }

  public static void main(String[] args) throws Exception {
    if (args.length != 1) {
      System.err.println("usage: EmberAppMaster <plan.json>");
      System.exit(2);
    }
    JsonNode plan = new ObjectMapper().readTree(new File(args[0]));
    int code = new EmberAppMaster(plan).run();
    // Hadoop's IPC and metrics leave non-daemon threads behind
    System.exit(code);
  }

  private int run() throws Exception {
    for (JsonNode r : plan.get("resources")) {
      LocalResourceType type = LocalResourceType.valueOf(r.get("type").asText());
      resources.put(r.get("name").asText(), LocalResource.newInstance(
          URL.fromURI(new URI(r.get("uri").asText())), type,
          LocalResourceVisibility.APPLICATION, r.get("size").asLong(),
          r.get("timestamp").asLong()));
    }
    taskTokens = tokensForTasks();
    rm = AMRMClientAsync.createAMRMClientAsync(ALLOCATING_HEARTBEAT_MS, new RmCallbacks());
    rm.init(conf);
    rm.start();
    nm = NMClientAsync.createNMClientAsync(new NmCallbacks());
    nm.init(conf);
    nm.start();
    rm.registerApplicationMaster("", 0, "");

    synchronized (this) {
      for (JsonNode t : plan.get("tasks")) {
        String type = t.get("type").asText();
        int instances = t.get("instances").asInt();
        int priority = TYPES.indexOf(type) + 1;
        if (priority == 0) throw new IllegalArgumentException("unknown task type " + type);
        Resource res = Resource.newInstance(t.get("memory_mb").asLong(), t.get("vcores").asInt());
        // YARN wants no label expression at all for the default partition
        String label = t.path("node_label").asText("");
        Deque<Task> q = new ArrayDeque<>();
        List<ContainerRequest> reqs = new ArrayList<>();
        for (int i = 0; i < instances; i++) {
          Task task = new Task(type, i);
          q.add(task);
          tasks.add(task);
          if (DECIDING.contains(type)) deciding++;
          ContainerRequest req = new ContainerRequest(res, null, null,
              Priority.newInstance(priority), true, label.isEmpty() ? null : label);
          reqs.add(req);
          rm.addContainerRequest(req);
        }
        unassigned.put(type, q);
        requests.put(type, reqs);
        log("asked for " + instances + " x " + type + " (" + res + (label.isEmpty() ? ""
            : ", label " + label) + ")");
      }
      if (deciding == 0) finish(FinalApplicationStatus.FAILED, null,
          "the plan has no chief, worker or evaluator task");
    }

    finished.await();
    stopRunning();
    writeReport();
    rm.unregisterApplicationMaster(status, truncate(diagnostics, 30000), "");
    log("unregistered: " + status);
    nm.stop();
    rm.stop();
    return status == FinalApplicationStatus.SUCCEEDED ? 0 : 1;
  }

  /* ------------------------------------------------------------ launching */

  private ContainerLaunchContext launchContext(Task t) {
    Map<String, String> env = new HashMap<>();
    plan.get("env").fields().forEachRemaining(e -> env.put(e.getKey(), e.getValue().asText()));
    env.put("EMBER_YARN_TASK", t.name());
    String cmd = plan.get("command").asText()
        + " 1>" + ApplicationConstants.LOG_DIR_EXPANSION_VAR + "/stdout"
        + " 2>" + ApplicationConstants.LOG_DIR_EXPANSION_VAR + "/stderr";
    return ContainerLaunchContext.newInstance(new HashMap<>(resources), env, List.of(cmd),
        null, taskTokens == null ? null : taskTokens.duplicate(), null);
  }

  /*
   * The tokens a task container gets: on a Kerberized grid the client's
   * HDFS delegation token (the tasks have no Kerberos ticket), everything
   * this AM was given except its own ResourceManager token, as YARN's
   * DistributedShell does.  null on a simple grid.
   */
  private static ByteBuffer tokensForTasks() throws IOException {
    if (!UserGroupInformation.isSecurityEnabled()) return null;
    Credentials mine = UserGroupInformation.getCurrentUser().getCredentials();
    Credentials theirs = new Credentials();
    for (Token<? extends TokenIdentifier> t : mine.getAllTokens()) {
      if (!AMRMTokenIdentifier.KIND_NAME.equals(t.getKind())) theirs.addToken(t.getService(), t);
    }
    DataOutputBuffer out = new DataOutputBuffer();
    theirs.writeTokenStorageToStream(out);
    log("tasks get " + theirs.numberOfTokens() + " token(s)");
    return ByteBuffer.wrap(out.getData(), 0, out.getLength());
  }

  private final class RmCallbacks extends AMRMClientAsync.AbstractCallbackHandler {
    @Override
    public void onContainersAllocated(List<Container> containers) {
      for (Container c : containers) {
        Task t = null;
        synchronized (EmberAppMaster.this) {
          int p = c.getPriority().getPriority();
          String type = p >= 1 && p <= TYPES.size() ? TYPES.get(p - 1) : "";
          Deque<Task> q = unassigned.get(type);
          if (!finishing && q != null && !q.isEmpty()) {
            t = q.poll();
            t.container = c;
            byContainer.put(c.getId(), t);
            // one fewer outstanding ask, or the RM keeps handing out containers
            rm.removeContainerRequest(requests.get(type).remove(0));
          }
        }
        if (t == null) {
          rm.releaseAssignedContainer(c.getId());
          continue;
        }
        log("starting " + t.name() + " in " + c.getId() + " on " + c.getNodeId());
        nm.startContainerAsync(c, launchContext(t));
      }
      synchronized (EmberAppMaster.this) {
        if (unassigned.values().stream().allMatch(Deque::isEmpty))
          rm.setHeartbeatInterval(HEARTBEAT_MS);
      }
    }

    @Override
    public void onContainersCompleted(List<ContainerStatus> statuses) {
      for (ContainerStatus s : statuses) {
        Task t;
        synchronized (EmberAppMaster.this) {
          t = byContainer.get(s.getContainerId());
          if (t == null || t.exitStatus != null) continue;
          t.exitStatus = s.getExitStatus();
          t.finishedMs = System.currentTimeMillis();
          t.diagnostics = s.getDiagnostics() == null ? "" : s.getDiagnostics().trim();
          EmberAppMaster.this.notifyAll();
          log(t.name() + " (" + s.getContainerId() + ") exited with status " + t.exitStatus);
          if (finishing || t.stoppedByAm) continue;
          if (t.exitStatus == 0) {
            if (DECIDING.contains(t.type) && --deciding == 0)
              finish(FinalApplicationStatus.SUCCEEDED, null, "");
            continue;
          }
        }
        taskFailed(t, "exited with code " + s.getExitStatus()
            + (s.getExitStatus() == ContainerExitStatus.KILLED_EXCEEDED_PMEM
                || s.getExitStatus() == ContainerExitStatus.KILLED_EXCEEDED_VMEM
                ? " (over its memory limit: raise the TaskSpec's memory)" : ""));
      }
    }

    @Override
    public void onContainersUpdated(List<UpdatedContainer> containers) {}

    @Override
    public void onShutdownRequest() {
      synchronized (EmberAppMaster.this) {
        finish(FinalApplicationStatus.FAILED, null, "the ResourceManager asked the AM to stop");
      }
    }

    @Override
    public void onNodesUpdated(List<NodeReport> updated) {}

    @Override
    public float getProgress() {
      synchronized (EmberAppMaster.this) {
        long total = tasks.stream().filter(t -> DECIDING.contains(t.type)).count();
        return total == 0 ? 0f : (float) (total - deciding) / total;
      }
    }

    @Override
    public void onError(Throwable e) {
      synchronized (EmberAppMaster.this) {
        finish(FinalApplicationStatus.FAILED, null, "AM <-> ResourceManager error: " + e);
      }
    }
  }

  private final class NmCallbacks extends NMClientAsync.AbstractCallbackHandler {
    @Override
    public void onContainerStarted(ContainerId id, Map<String, java.nio.ByteBuffer> data) {
      synchronized (EmberAppMaster.this) {
        Task t = byContainer.get(id);
        if (t != null) t.startedMs = System.currentTimeMillis();
      }
    }

    @Override
    public void onStartContainerError(ContainerId id, Throwable e) {
      Task t;
      synchronized (EmberAppMaster.this) {
        t = byContainer.get(id);
      }
      if (t != null) taskFailed(t, "could not be started: " + e);
    }

    @Override
    public void onContainerStatusReceived(ContainerId id, ContainerStatus s) {}

    @Override
    public void onContainerStopped(ContainerId id) {}

    @Override
    public void onGetContainerStatusError(ContainerId id, Throwable e) {}

    @Override
    public void onContainerResourceIncreased(ContainerId id, Resource r) {}

    @Override
    public void onContainerResourceUpdated(ContainerId id, Resource r) {}

    @Override
    public void onIncreaseContainerResourceError(ContainerId id, Throwable e) {}

    @Override
    public void onUpdateContainerResourceError(ContainerId id, Throwable e) {}

    @Override
    public void onStopContainerError(ContainerId id, Throwable e) {
      log("stopping " + id + ": " + e);
    }
  }

  /* ------------------------------------------------------------ ending */

  /*
   * A task failed: the first failure decides (others that fail because of it,
   * e.g. peers whose collective broke, are not the cause).  The log tails are
   * fetched before the AM finishes: once the application ends, the
   * NodeManager aggregates and removes the container logs.
   */
  private void taskFailed(Task t, String why) {
    synchronized (this) {
      if (finishing) return;
      finishing = true; // no new launches while we fetch logs
    }
    for (String file : List.of("stderr", "stdout")) {
      String tail = fetchLogTail(t, file);
      if (tail != null && !tail.isEmpty()) t.logTail.put(file, tail);
    }
    Container c = t.container;
    String where = c == null ? "" : " (container " + c.getId() + " on " + c.getNodeId().getHost()
        + ")";
    StringBuilder d = new StringBuilder("task " + t.name() + where + " " + why);
    if (!t.diagnostics.isEmpty()) d.append("\nYARN: ").append(truncate(t.diagnostics, 2000));
    String err = t.logTail.get("stderr");
    if (err != null) d.append("\n--- ").append(t.name()).append(" stderr (tail) ---\n")
        .append(tail(err, 4000));
    synchronized (this) {
      finishing = false;
      finish(FinalApplicationStatus.FAILED, t, d.toString());
    }
  }

  /* Caller holds the lock. */
  private void finish(FinalApplicationStatus s, Task cause, String why) {
    if (status != FinalApplicationStatus.UNDEFINED) return;
    finishing = true;
    status = s;
    failed = cause;
    diagnostics = why;
    log("finishing " + s + (why.isEmpty() ? "" : ": " + why.lines().findFirst().orElse("")));
    finished.countDown();
  }

  /*
   * Stops the containers still running (ps and tensorboard after a success;
   * everything after a failure) and waits up to 20 s for their exits, so that
   * the report has their statuses.  Unregistering would have the RM kill them
   * anyway.
   */
  private void stopRunning() throws InterruptedException {
    synchronized (this) {
      for (Task t : tasks) {
        if (t.container != null && t.exitStatus == null) {
          t.stoppedByAm = true;
          log("stopping " + t.name() + " (" + t.container.getId() + ")");
          nm.stopContainerAsync(t.container.getId(), t.container.getNodeId());
        }
      }
      long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
      while (tasks.stream().anyMatch(t -> t.stoppedByAm && t.exitStatus == null)) {
        long left = TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime());
        if (left <= 0) break;
        wait(left);
      }
    }
  }

  private synchronized void writeReport() {
    ObjectMapper om = new ObjectMapper();
    ObjectNode root = om.createObjectNode();
    root.put("final_status", status.toString());
    root.put("diagnostics", diagnostics);
    root.put("failed_task", failed == null ? null : failed.name());
    ArrayNode arr = root.putArray("tasks");
    for (Task t : tasks) {
      ObjectNode o = arr.addObject();
      o.put("task", t.name());
      o.put("container", t.container == null ? null : t.container.getId().toString());
      o.put("host", t.container == null ? null : t.container.getNodeId().getHost());
      o.put("node_http", t.container == null ? null : t.container.getNodeHttpAddress());
      if (t.exitStatus == null) o.putNull("exit_status");
      else o.put("exit_status", t.exitStatus.intValue());
      o.put("started_ms", t.startedMs);
      o.put("finished_ms", t.finishedMs);
      o.put("stopped_by_am", t.stoppedByAm);
      o.put("diagnostics", truncate(t.diagnostics, 4000));
      ObjectNode logs = o.putObject("log_tail");
      t.logTail.forEach(logs::put);
    }
    Path p = new Path(plan.get("report").asText());
    try (FileSystem fs = p.getFileSystem(conf); OutputStream out = fs.create(p, true)) {
      out.write(om.writerWithDefaultPrettyPrinter().writeValueAsBytes(root));
    } catch (IOException e) {
      // the client still has the application's diagnostics
      log("could not write the report to " + p + ": " + e);
    }
  }

  /*
   * The last bytes of a container log, from its NodeManager's REST API
   * (/ws/v1/node/containerlogs/<id>/<file>?size=-N, Hadoop 3), or null.
   */
  private String fetchLogTail(Task t, String file) {
    if (t.container == null) return null;
    int n = plan.path("log_tail_bytes").asInt(4096);
    String user = URLEncoder.encode(plan.path("user").asText(""), StandardCharsets.UTF_8);
    String url = "http://" + t.container.getNodeHttpAddress() + "/ws/v1/node/containerlogs/"
        + t.container.getId() + "/" + file + "?size=-" + n + "&user.name=" + user;
    try {
      HttpURLConnection h = (HttpURLConnection) new java.net.URL(url).openConnection();
      h.setConnectTimeout(5000);
      h.setReadTimeout(10000);
      h.setRequestProperty("Accept", "text/plain");
      if (h.getResponseCode() != 200) {
        log("log " + file + " of " + t.name() + ": HTTP " + h.getResponseCode() + " from " + url);
        return null;
      }
      try (InputStream in = h.getInputStream()) {
        // bounded: the NM should send n bytes, but do not trust a log to be short
        ByteArrayOutputStream buf = new ByteArrayOutputStream();
        byte[] b = new byte[8192];
        int r;
        while ((r = in.read(b)) > 0 && buf.size() < 4 * n + 65536) buf.write(b, 0, r);
        return tail(logContents(buf.toString(StandardCharsets.UTF_8)), n);
      }
    } catch (IOException e) {
      log("log " + file + " of " + t.name() + ": " + e);
      return null;
    }
  }

  /*
   * The NodeManager wraps a log in a header ("Container: ...", "LogType:",
   * "LogContents:") and a trailer ("End of LogType:..."); keep the log.
   */
  private static String logContents(String page) {
    int start = page.indexOf("LogContents:\n");
    if (start < 0) return page;
    start += "LogContents:\n".length();
    int end = page.lastIndexOf("End of LogType:");
    return page.substring(start, end >= start ? end : page.length());
  }

  private static String tail(String s, int n) {
    return s.length() <= n ? s : s.substring(s.length() - n);
  }

  private static String truncate(String s, int n) {
    return s.length() <= n ? s : s.substring(0, n) + "...";
  }

  private static void log(String msg) {
    System.err.println(java.time.LocalDateTime.now() + " EmberAppMaster: " + msg);
    System.err.flush();
  }
}
