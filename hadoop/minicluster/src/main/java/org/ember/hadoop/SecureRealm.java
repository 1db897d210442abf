/*
 * SecureRealm - the Kerberos side of MiniHadoop --secure: a KDC (Hadoop's
 * MiniKdc, Apache Kerby inside this JVM), the principals and keytabs a
 * Kerberized grid has, and the configuration keys that make HDFS and YARN
 * demand Kerberos, with SPNEGO on their web endpoints (WebHDFS, the
 * ResourceManager's REST API).
 *
 * Every service (NameNode, DataNode, ResourceManager, NodeManager) runs as
 * one principal, <user>/localhost@EXAMPLE.COM, in one keytab: they share
 * this JVM and its login, and Hadoop's default auth_to_local maps that
 * principal to <user>, the HDFS superuser, as on the insecure cluster.  The
 * web endpoints use HTTP/localhost@EXAMPLE.COM, the name a SPNEGO client
 * derives from a URL naming host "localhost" (clients must not canonicalise
 * it: the krb5.conf written for them says so).  Users: <user>@EXAMPLE.COM
 * (the tests' user, with its own keytab) and alice@EXAMPLE.COM (a second
 * user, for permission checks), each with a keytab of its own.
 */
package org.ember.hadoop;

import java.io.File;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.lang.reflect.Field;
import java.net.URI;
import java.nio.file.Files;
import java.security.PrivilegedExceptionAction;
import java.util.Map;
import java.util.Properties;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.hdfs.security.token.delegation.DelegationTokenSecretManager;
import org.apache.hadoop.hdfs.server.namenode.NameNodeAdapter;
import org.apache.hadoop.minikdc.MiniKdc;
import org.apache.hadoop.security.Credentials;
import org.apache.hadoop.security.UserGroupInformation;
import org.apache.hadoop.security.token.Token;
import org.apache.hadoop.security.token.delegation.AbstractDelegationTokenSecretManager;

final class SecureRealm {
  static final String HOST = "localhost";

  final MiniKdc kdc;
  final String realm;
  final String servicePrincipal;
  final String httpPrincipal;
  final String userPrincipal;
  final String otherUserPrincipal;
  final File serviceKeytab;
  final File userKeytab;
  final File otherUserKeytab;

  private SecureRealm(MiniKdc kdc, String user, File dir) throws Exception {
    this.kdc = kdc;
    this.realm = kdc.getRealm();
    serviceKeytab = new File(dir, "services.keytab");
    userKeytab = new File(dir, user + ".keytab");
    otherUserKeytab = new File(dir, "alice.keytab");
    kdc.createPrincipal(serviceKeytab, user + "/" + HOST, "HTTP/" + HOST);
    kdc.createPrincipal(userKeytab, user);
    kdc.createPrincipal(otherUserKeytab, "alice");
    servicePrincipal = user + "/" + HOST + "@" + realm;
    httpPrincipal = "HTTP/" + HOST + "@" + realm;
    userPrincipal = user + "@" + realm;
    otherUserPrincipal = "alice@" + realm;
  }

  /* Starts the KDC under dir (its port picked by the system). */
  static SecureRealm start(File dir, String user) throws Exception {
    if (!dir.isDirectory() && !dir.mkdirs()) throw new IOException("cannot create " + dir);
    Properties p = MiniKdc.createConf();
    p.setProperty(MiniKdc.KDC_BIND_ADDRESS, HOST);
    // short tickets must be grantable: tests ask for a ticket that expires
    // within seconds to check what a user with an expired ticket is told
    p.setProperty(MiniKdc.MIN_TICKET_LIFETIME, "1000");
    MiniKdc kdc = new MiniKdc(p, dir);
    kdc.start();
    return new SecureRealm(kdc, user, dir);
  }

  /* The server-side keys: Kerberos for RPC, SPNEGO for the web endpoints. */
  void configureServers(Configuration c) {
    configureClients(c);
    String kt = serviceKeytab.getPath();
    c.set("dfs.namenode.keytab.file", kt);
    c.set("dfs.datanode.kerberos.principal", servicePrincipal);
    c.set("dfs.datanode.keytab.file", kt);
    c.set("dfs.web.authentication.kerberos.principal", httpPrincipal);
    c.set("dfs.web.authentication.kerberos.keytab", kt);
    c.set("dfs.namenode.kerberos.internal.spnego.principal", httpPrincipal);
    c.setBoolean("dfs.block.access.token.enable", true);
    // A secure DataNode needs privileged ports (started as root through
    // jsvc) or SASL on its data transfer with HTTPS; Hadoop's own tests of
    // Kerberized HDFS waive that with this key, which changes nothing a
    // client sees (WebHDFS still redirects with a delegation token).
    c.setBoolean("ignore.secure.ports.for.testing", true);
    c.set("hadoop.http.authentication.type", "kerberos");
    c.set("hadoop.http.authentication.kerberos.principal", httpPrincipal);
    c.set("hadoop.http.authentication.kerberos.keytab", kt);
    c.setBoolean("hadoop.http.authentication.simple.anonymous.allowed", false);
    c.set("yarn.resourcemanager.keytab", kt);
    c.set("yarn.nodemanager.principal", servicePrincipal);
    c.set("yarn.nodemanager.keytab", kt);
    c.set("yarn.resourcemanager.webapp.spnego-principal", httpPrincipal);
    c.set("yarn.resourcemanager.webapp.spnego-keytab-file", kt);
    c.set("yarn.nodemanager.webapp.spnego-principal", httpPrincipal);
    c.set("yarn.nodemanager.webapp.spnego-keytab-file", kt);
    // the RM's REST API takes SPNEGO (and its own delegation tokens)
    c.setBoolean("yarn.resourcemanager.webapp.delegation-token-auth-filter.enabled", true);
  }

  /* What every client of the grid needs to know (core-, hdfs-, yarn-site). */
  void configureClients(Configuration c) {
    c.set("hadoop.security.authentication", "kerberos");
    c.set("dfs.namenode.kerberos.principal", servicePrincipal);
    c.set("yarn.resourcemanager.principal", servicePrincipal);
  }

  /*
   * A krb5.conf for clients (MIT kinit, libcurl's GSS-API, a JVM): the
   * realm's KDC over TCP (Kerby listens on TCP only), no DNS games with host
   * names, so HTTP/localhost is the principal asked for.
   */
  File writeClientKrb5Conf(File dir) throws IOException {
    String conf = "[libdefaults]\n"
        + "  default_realm = " + realm + "\n"
        + "  dns_lookup_kdc = false\n"
        + "  dns_lookup_realm = false\n"
        + "  dns_canonicalize_hostname = false\n"
        + "  rdns = false\n"
        + "  udp_preference_limit = 1\n"
        + "  forwardable = true\n"
        + "  ticket_lifetime = 24h\n"
        + "  renew_lifetime = 7d\n"
        + "\n[realms]\n"
        + "  " + realm + " = {\n"
        + "    kdc = " + HOST + ":" + kdc.getPort() + "\n"
        + "  }\n"
        + "\n[domain_realm]\n"
        + "  " + HOST + " = " + realm + "\n";
    File f = new File(dir, "krb5.conf");
    Files.write(f.toPath(), conf.getBytes(StandardCharsets.UTF_8));
    return f;
  }

  /*
   * Token files as YARN hands them to a container (Hadoop's Credentials
   * format): the user's HDFS delegation token, obtained over RPC with the
   * user's Kerberos login as Spark's and YARN's clients do, and a second
   * one the NameNode then treats as expired (its renewal date moved into
   * the past inside the NameNode's secret manager: a real expiry would take
   * a day).  Returns {valid, expired}.
   */
  File[] writeTokenFiles(MiniDFSCluster dfs, String fsUri, String user, File dir)
      throws Exception {
    Configuration conf = new Configuration(dfs.getConfiguration(0));
    UserGroupInformation ugi =
        UserGroupInformation.loginUserFromKeytabAndReturnUGI(userPrincipal, userKeytab.getPath());
    File valid = new File(dir, user + ".tokens");
    File expired = new File(dir, user + "-expired.tokens");
    Token<?> stale = ugi.doAs((PrivilegedExceptionAction<Token<?>>) () -> {
      try (FileSystem fs = FileSystem.newInstance(URI.create(fsUri), conf)) {
        Credentials good = new Credentials();
        fs.addDelegationTokens(user, good);
        good.writeTokenStorageFile(new Path(valid.toURI()), conf);
        Credentials old = new Credentials();
        Token<?>[] t = fs.addDelegationTokens(user, old);
        old.writeTokenStorageFile(new Path(expired.toURI()), conf);
        return t[0];
      }
    });
    DelegationTokenSecretManager sm = NameNodeAdapter.getDtSecretManager(dfs.getNamesystem());
    Field current = AbstractDelegationTokenSecretManager.class.getDeclaredField("currentTokens");
    current.setAccessible(true);
    @SuppressWarnings("unchecked")
    Map<Object, Object> tokens = (Map<Object, Object>) current.get(sm);
    tokens.put(stale.decodeIdentifier(),
        new AbstractDelegationTokenSecretManager.DelegationTokenInformation(
            System.currentTimeMillis() - 60_000L, stale.getPassword()));
    return new File[] {valid, expired};
  }

  void stop() {
    kdc.stop();
  }
}
