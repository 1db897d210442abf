/*
 * MiniHadoop - Ember's test Hadoop: an HDFS (MiniDFSCluster: NameNode + 1
 * DataNode, WebHDFS on) and a YARN (MiniYARNCluster: ResourceManager + 1
 * NodeManager) in this one JVM, on 127.0.0.1.
 *
 *   java <--add-opens ...> -cp <jar>:<classpath> org.ember.hadoop.MiniHadoop \
 *        --conf-dir DIR [--work-dir DIR] [--no-yarn] [--secure] [-Dkey=value ...]
 *
 * It writes a client configuration (core-site.xml, hdfs-site.xml,
 * yarn-site.xml) to --conf-dir, prints one line on stdout
 *
 *   EMBER-HADOOP READY fs=hdfs://127.0.0.1:P webhdfs=http://127.0.0.1:P
 *                      rm=127.0.0.1:P rm_web=http://127.0.0.1:P conf=DIR
 *
 * (on one line), and runs until its stdin reaches end of file (the parent
 * closed the pipe or died), then stops both clusters and exits 0.  Anything
 * that goes wrong before READY prints "EMBER-HADOOP FAILED <reason>" and
 * exits 1.  Logs go to stderr.  -Dkey=value options override the cluster
 * configuration (e.g. -Dyarn.nodemanager.resource.memory-mb=8192).
 *
 * With --secure the clusters are Kerberized (see SecureRealm): a KDC starts
 * first, HDFS and YARN demand Kerberos on RPC and SPNEGO on their web
 * endpoints, every address is "localhost" (the host of the HTTP/ principal),
 * the configuration directory also holds krb5.conf and the keytabs, and the
 * READY line adds
 *
 *   realm=EXAMPLE.COM kdc=localhost:P krb5conf=FILE principal=USER@REALM
 *   keytab=FILE other_principal=alice@REALM other_keytab=FILE
 *   token_file=FILE expired_token_file=FILE
 *
 * Everything listens on loopback only: an unauthenticated YARN reachable
 * from the network runs anyone's code.
 */
package org.ember.hadoop;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.security.UserGroupInformation;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;

public final class MiniHadoop {
  private static final String LOOPBACK = "127.0.0.1";

  private MiniHadoop() {}

  private static void usage(String why) {
    System.err.println("MiniHadoop: " + why);
    System.err.println("usage: MiniHadoop --conf-dir DIR [--work-dir DIR] [--no-yarn] "
        + "[--secure] [-Dkey=value ...]");
    System.exit(2);
  }

  public static void main(String[] args) throws Exception {
    File confDir = null;
    File workDir = null;
    boolean yarnOn = true;
    boolean secure = false;
    Map<String, String> overrides = new TreeMap<>();
    for (int i = 0; i < args.length; i++) {
      String a = args[i];
      if (a.equals("--conf-dir") && i + 1 < args.length) {
        confDir = new File(args[++i]).getAbsoluteFile();
      } else if (a.equals("--work-dir") && i + 1 < args.length) {
        workDir = new File(args[++i]).getAbsoluteFile();
      } else if (a.equals("--no-yarn")) {
        yarnOn = false;
      } else if (a.equals("--secure")) {
        secure = true;
      } else if (a.startsWith("-D") && a.indexOf('=') > 2) {
        int eq = a.indexOf('=');
        overrides.put(a.substring(2, eq), a.substring(eq + 1));
      } else {
        usage("unknown or incomplete argument: " + a);
      }
    }
    if (confDir == null) usage("--conf-dir is required");
    if (workDir == null) workDir = new File(confDir.getParentFile(), "hadoop-work");

    MiniDFSCluster dfs = null;
    MiniYARNCluster yarn = null;
    SecureRealm realm = null;
    try {
      long t0 = System.nanoTime();
      if (!workDir.isDirectory() && !workDir.mkdirs())
        throw new IOException("cannot create work dir " + workDir);
      if (!confDir.isDirectory() && !confDir.mkdirs())
        throw new IOException("cannot create conf dir " + confDir);

      // The OS user, before any Kerberos login makes the login user a service
      String osUser = System.getProperty("user.name");
      String host = LOOPBACK;
      if (secure) {
        realm = SecureRealm.start(new File(workDir, "kdc"), osUser);
        host = SecureRealm.HOST;
        log(String.format("KDC up for %s at %s:%d in %.1fs", realm.realm, SecureRealm.HOST,
            realm.kdc.getPort(), secs(t0)));
      }

      // ---------------------------------------------------------------- HDFS
      Configuration conf = new Configuration();
      if (realm != null) {
        realm.configureServers(conf);
        UserGroupInformation.setConfiguration(conf);
      }
      conf.set("hadoop.tmp.dir", new File(workDir, "tmp").getPath());
      conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, new File(workDir, "dfs").getPath());
      conf.setBoolean("dfs.webhdfs.enabled", true);
      conf.setInt("dfs.replication", 1);
      // small blocks so that multi-block files (and reads across block
      // boundaries) are cheap to make in tests
      conf.setLong("dfs.blocksize", 1L << 20);
      conf.setLong("dfs.namenode.fs-limits.min-block-size", 4096);
      conf.set("dfs.namenode.rpc-bind-host", LOOPBACK);
      conf.set("dfs.namenode.http-bind-host", LOOPBACK);
      // the NameNode's thread that drops deleted files' blocks wakes every
      // this many ms, idle or not: at the default 10 it was half of an idle
      // test cluster's CPU (0.7 of 1.3 CPU s a minute, for the half hour
      // a test lane keeps it)
      conf.setLong("dfs.namenode.block.deletion.unlock.interval.ms", 500);
      // the ResourceManager keeps YARN on loopback; the same for its peers
      conf.set("yarn.resourcemanager.bind-host", LOOPBACK);
      conf.set("yarn.nodemanager.bind-host", LOOPBACK);
      for (Map.Entry<String, String> e : overrides.entrySet()) conf.set(e.getKey(), e.getValue());

      dfs = new MiniDFSCluster.Builder(conf, new File(workDir, "dfs"))
          .numDataNodes(1)
          .storagesPerDatanode(1)
          .nameNodePort(0)
          .nameNodeHttpPort(0)
          .format(true)
          .build();
      dfs.waitActive();
      int nnPort = dfs.getNameNodePort();
      InetSocketAddress nnHttp = dfs.getNameNode().getHttpAddress();
      String fsUri = "hdfs://" + host + ":" + nnPort;
      String webhdfs = "http://" + host + ":" + nnHttp.getPort();

      // Directories every Hadoop client expects: a world-writable /tmp
      // (sticky, as on real grids) and the current user's home, where YARN
      // clients stage their files.
      String user = secure ? osUser : UserGroupInformation.getCurrentUser().getShortUserName();
      FileSystem fs = dfs.getFileSystem();
      fs.mkdirs(new Path("/tmp"));
      fs.setPermission(new Path("/tmp"), new FsPermission((short) 01777));
      fs.mkdirs(new Path("/user/" + user));
      log(String.format("HDFS up at %s (WebHDFS %s) in %.1fs", fsUri, webhdfs, secs(t0)));

      // ---------------------------------------------------------------- YARN
      Configuration clientYarn = null;
      String rm = "";
      String rmWeb = "";
      if (yarnOn) {
        YarnConfiguration yconf = new YarnConfiguration(dfs.getConfiguration(0));
        yconf.set("fs.defaultFS", fsUri);
        // hadoop-client-minicluster carries no capacity-scheduler.xml: declare
        // the one queue ourselves, as Spark's BaseYarnClusterSuite does.
        yconf.set("yarn.scheduler.capacity.root.queues", "default");
        yconf.setInt("yarn.scheduler.capacity.root.default.capacity", 100);
        yconf.setFloat("yarn.scheduler.capacity.root.default.user-limit-factor", 1);
        yconf.setInt("yarn.scheduler.capacity.root.default.maximum-capacity", 100);
        yconf.set("yarn.scheduler.capacity.root.default.state", "RUNNING");
        yconf.set("yarn.scheduler.capacity.root.default.acl_submit_applications", "*");
        yconf.set("yarn.scheduler.capacity.root.default.acl_administer_queue", "*");
        yconf.setInt("yarn.scheduler.capacity.node-locality-delay", -1);
        // a nearly full disk on a laptop or CI runner must not mark the only
        // NodeManager unhealthy
        yconf.setFloat(
            "yarn.nodemanager.disk-health-checker.max-disk-utilization-per-disk-percentage",
            100.0f);
        // a NodeManager's heartbeat is when the scheduler hands out its
        // containers: every test application waits for a few of them
        // (1000 ms by default, meant for clusters of thousands of nodes)
        yconf.setInt("yarn.resourcemanager.nodemanagers.heartbeat-interval-ms", 250);
        yconf.setBoolean("yarn.log-aggregation-enable", true);
        yconf.set("yarn.nodemanager.remote-app-log-dir", "/tmp/logs");
        for (Map.Entry<String, String> e : overrides.entrySet()) yconf.set(e.getKey(), e.getValue());

        // MiniYARNCluster works under ./target/<name>: the caller runs us
        // with the work dir as the current directory.
        yarn = new MiniYARNCluster("ember", 1, 1, 1);
        yarn.init(yconf);
        yarn.start();

        // start() can return before the RM has written its bound address
        // back into the configuration (the port still reads 0): poll, as
        // Spark's YARN suite does.
        Configuration live = yarn.getConfig();
        long deadline = System.nanoTime() + 30_000_000_000L;
        while (portOf(live.get(YarnConfiguration.RM_ADDRESS)) == 0
            || portOf(live.get(YarnConfiguration.RM_WEBAPP_ADDRESS)) == 0) {
          if (System.nanoTime() > deadline)
            throw new IOException("ResourceManager address still ends in :0 after 30s: "
                + live.get(YarnConfiguration.RM_ADDRESS));
          Thread.sleep(100);
        }
        if (!yarn.waitForNodeManagersToConnect(30_000))
          throw new IOException("the NodeManager did not register with the ResourceManager in 30s");
        int rmWebPort = portOf(live.get(YarnConfiguration.RM_WEBAPP_ADDRESS));
        try {
          rmWebPort = WebAppRouting.install(yarn, 1);
        } catch (Exception e) {
          log("warning: could not route the RM and NM web apps apart (" + e
              + "); the RM REST API will answer with the NodeManager's pages");
        }
        live.set(YarnConfiguration.RM_WEBAPP_ADDRESS, LOOPBACK + ":" + rmWebPort);
        rm = host + ":" + portOf(live.get(YarnConfiguration.RM_ADDRESS));
        rmWeb = "http://" + host + ":" + rmWebPort;
        clientYarn = live;
        InetAddress local = InetAddress.getLocalHost();
        if (!local.isLoopbackAddress())
          log("warning: this host's name " + local.getHostName() + " resolves to "
              + local.getHostAddress() + ", not loopback; the NodeManager is named after it,"
              + " so YARN containers may not be reachable");
        log(String.format("YARN up: RM %s (web %s) in %.1fs", rm, rmWeb, secs(t0)));
      }

      writeClientConf(confDir, dfs.getConfiguration(0), clientYarn, fsUri, host, nnPort,
          nnHttp.getPort(), realm);
      String kerberos = "";
      if (realm != null) {
        File krb5 = realm.writeClientKrb5Conf(confDir);
        kerberos = " realm=" + realm.realm + " kdc=" + SecureRealm.HOST + ":" + realm.kdc.getPort()
            + " krb5conf=" + krb5.getPath() + " principal=" + realm.userPrincipal
            + " keytab=" + realm.userKeytab.getPath() + " other_principal="
            + realm.otherUserPrincipal + " other_keytab=" + realm.otherUserKeytab.getPath();
        File[] tokens = realm.writeTokenFiles(dfs, fsUri, user, confDir);
        kerberos += " token_file=" + tokens[0].getPath() + " expired_token_file="
            + tokens[1].getPath();
      }

      System.out.println("EMBER-HADOOP READY fs=" + fsUri + " webhdfs=" + webhdfs
          + " rm=" + rm + " rm_web=" + rmWeb + " conf=" + confDir.getPath()
          + " user=" + user + kerberos);
      System.out.flush();

      // Run until the parent closes our stdin (or dies, which closes it).
      InputStream in = System.in;
      byte[] sink = new byte[256];
      while (in.read(sink) >= 0) {
        // input is ignored; only end of file matters
      }
      log("stdin closed: stopping");
    } catch (Throwable t) {
      System.out.println("EMBER-HADOOP FAILED " + t.toString().replace('\n', ' '));
      System.out.flush();
      t.printStackTrace();
      stopQuietly(yarn, dfs, realm);
      System.exit(1);
    }
    stopQuietly(yarn, dfs, realm);
    System.out.println("EMBER-HADOOP STOPPED");
    System.out.flush();
    // Hadoop leaves non-daemon threads (metrics, IPC) behind after stop().
    System.exit(0);
  }

  private static void stopQuietly(MiniYARNCluster yarn, MiniDFSCluster dfs, SecureRealm realm) {
    if (yarn != null) {
      try {
        yarn.stop();
      } catch (Throwable t) {
        log("stopping YARN: " + t);
      }
    }
    if (dfs != null) {
      try {
        dfs.shutdown(true);
      } catch (Throwable t) {
        log("stopping HDFS: " + t);
      }
    }
    if (realm != null) realm.stop();
  }

  private static int portOf(String hostPort) {
    if (hostPort == null) return 0;
    int colon = hostPort.lastIndexOf(':');
    try {
      return Integer.parseInt(hostPort.substring(colon + 1).trim());
    } catch (NumberFormatException e) {
      return 0;
    }
  }

  /*
   * The client configuration: what a Hadoop client (hdfs CLI, Spark, Ember's
   * WebHDFS reader) needs to reach these clusters, with every address
   * rewritten to 127.0.0.1 and the actual port.  yarn-site.xml carries every
   * yarn.* key the mini cluster set itself (not the yarn-default.xml values),
   * as Spark's YARN suite writes the whole live config.
   */
  private static void writeClientConf(File dir, Configuration dfsConf, Configuration yarnConf,
      String fsUri, String host, int nnPort, int nnHttpPort, SecureRealm realm)
      throws IOException {
    Configuration core = new Configuration(false);
    core.set("fs.defaultFS", fsUri);
    core.set("hadoop.security.authentication", "simple");
    if (realm != null) {
      core.set("hadoop.security.authentication", "kerberos");
      core.set("hadoop.http.authentication.type", "kerberos");
    }
    write(core, new File(dir, "core-site.xml"));

    Configuration hdfs = new Configuration(false);
    hdfs.set("dfs.namenode.rpc-address", host + ":" + nnPort);
    hdfs.set("dfs.namenode.http-address", host + ":" + nnHttpPort);
    if (realm != null) {
      hdfs.set("dfs.namenode.kerberos.principal", realm.servicePrincipal);
      hdfs.set("dfs.block.access.token.enable", "true");
    }
    hdfs.set("dfs.webhdfs.enabled", "true");
    hdfs.set("dfs.replication", "1");
    hdfs.set("dfs.blocksize", dfsConf.get("dfs.blocksize"));
    write(hdfs, new File(dir, "hdfs-site.xml"));

    Configuration y = new Configuration(false);
    if (yarnConf != null) {
      List<String> keys = new ArrayList<>();
      for (Map.Entry<String, String> e : yarnConf) {
        if (e.getKey().startsWith("yarn.") && setHere(yarnConf, e.getKey())) keys.add(e.getKey());
      }
      for (String k : keys) {
        String v = yarnConf.get(k);
        if (k.startsWith("yarn.resourcemanager.") && k.endsWith("address") && portOf(v) > 0)
          v = host + ":" + portOf(v);
        y.set(k, v);
      }
      y.set("yarn.resourcemanager.hostname", host);
    }
    write(y, new File(dir, "yarn-site.xml"));
  }

  /* Whether key was set by us or the mini cluster, not by a *-default.xml. */
  private static boolean setHere(Configuration c, String key) {
    String[] src = c.getPropertySources(key);
    if (src == null) return true;
    for (String s : src) {
      if (!s.endsWith("-default.xml")) return true;
    }
    return false;
  }

  private static void write(Configuration c, File f) throws IOException {
    File tmp = new File(f.getPath() + ".tmp");
    try (OutputStream out = new FileOutputStream(tmp)) {
      c.writeXml(out);
    }
    Files.move(tmp.toPath(), f.toPath(), java.nio.file.StandardCopyOption.REPLACE_EXISTING,
        java.nio.file.StandardCopyOption.ATOMIC_MOVE);
  }

  private static double secs(long t0) {
    return (System.nanoTime() - t0) / 1e9;
  }

  private static void log(String msg) {
    System.err.println("MiniHadoop: " + msg);
    System.err.flush();
  }
}
